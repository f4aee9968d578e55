"""The node's default name: made once per data dir, kept, and an upgraded data dir keeps the host name."""

from __future__ import annotations

import socket

from gateway.settings import NODE_FILE, Settings


def test_each_data_dir_names_its_node_once(tmp_path, monkeypatch):
    monkeypatch.delenv("FORKYARD_NODE", raising=False)
    a, b = Settings(data_dir=tmp_path / "a"), Settings(data_dir=tmp_path / "b")
    assert a.node != b.node and a.node.startswith(socket.gethostname() + "-")
    assert Settings(data_dir=tmp_path / "a").node == a.node == (tmp_path / "a" / NODE_FILE).read_text().strip()
    assert Settings(data_dir=tmp_path / "a", node="named").node == "named"
    monkeypatch.setenv("FORKYARD_NODE", "from-env")
    assert Settings(data_dir=tmp_path / "b").node == "from-env"


def test_a_data_dir_from_before_node_files_keeps_the_host_name(tmp_path, monkeypatch):
    monkeypatch.delenv("FORKYARD_NODE", raising=False)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "forkyard.db").write_bytes(b"")
    assert Settings(data_dir=tmp_path / "old").node == socket.gethostname()
