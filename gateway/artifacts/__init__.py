"""Artifacts: files a step made (a web page's screenshot), stored once and served by id."""
