#!/bin/bash
# Verifier for fix-permissions: check owners and modes with stat. Always writes reward.txt.
mkdir -p /logs/verifier
fail() { echo "FAIL: $*"; echo 0 > /logs/verifier/reward.txt; exit 0; }
check_mode() {  # path expected-mode
    [ -e "$1" ] || fail "$1 does not exist"
    local mode
    mode=$(stat -c %a "$1")
    [ "$mode" = "$2" ] || fail "$1 has mode $mode, want $2"
}
id deploy > /dev/null 2>&1 || fail "user deploy is gone"
while IFS= read -r -d '' path; do
    owner=$(stat -c %U:%G "$path")
    [ "$owner" = "deploy:deploy" ] || fail "$path is owned by $owner, want deploy:deploy"
done < <(find /srv/app -print0)
check_mode /srv/app/bin/start.sh 750
check_mode /srv/app/secrets 700
for f in /srv/app/secrets/api.key /srv/app/secrets/db.env; do check_mode "$f" 600; done
for f in /srv/app/config/server.conf /srv/app/config/logging.conf; do check_mode "$f" 640; done
[ -d /srv/app/logs ] || fail "/srv/app/logs is not a directory"
check_mode /srv/app/logs 755
grep -q '^api_key=sk-test-0000000000000000$' /srv/app/secrets/api.key || fail "secrets/api.key was changed"
echo "PASS"
echo 1 > /logs/verifier/reward.txt
