#!/usr/bin/env bash
# Fetches vLLM 0.32.0's own unit tests: the `tests/` tree of its source distribution
# (vllm-0.32.0.tar.gz), unpacked into tests/conformance/.vllm_tests/tests/ (git-ignored; nothing of
# vLLM's is committed). tests/conformance/vllm_tests/ runs some of them against minivllm.
#
# `pip download vllm==0.32.0 --no-binary :all:` tries to build the sdist and fails, so the file's
# URL comes from the package index's simple API (PEP 691 JSON, or the PEP 503 HTML page): the index
# pip is configured with (PIP_INDEX_URL, then `pip config get global.index-url`, then PyPI). The
# archive's sha256 is checked against the index's. Idempotent: a finished folder is left as it is
# (MINIVLLM_VLLM_TESTS moves it). Prints how long it took. Called by setup_vllm.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="${MINIVLLM_VLLM_TESTS:-$ROOT/tests/conformance/.vllm_tests}"
PY="${PYTHON:-python3}"
VERSION="0.32.0"
READY="$DEST/.minivllm-vllm-tests-ready"
start=$(date +%s)

if [ -f "$READY" ] && [ "$(cat "$READY")" = "$VERSION" ] && [ -d "$DEST/tests/v1" ]; then
    echo "vLLM $VERSION tests already at $DEST (0 s)"
    exit 0
fi

INDEX="${PIP_INDEX_URL:-$("$PY" -m pip config get global.index-url 2>/dev/null || true)}"
INDEX="${INDEX:-https://pypi.org/simple}"
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" - "$INDEX" "$VERSION" "$DEST" <<'PY'
import hashlib
import html.parser
import json
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request

index, version, dest = sys.argv[1].rstrip("/"), sys.argv[2], sys.argv[3]
filename = f"vllm-{version}.tar.gz"
page = f"{index}/vllm/"
req = urllib.request.Request(page, headers={
    "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
with urllib.request.urlopen(req, timeout=60) as r:
    ctype, body = r.headers.get("Content-Type", ""), r.read()
url = sha256 = None
if "json" in ctype:
    for f in json.loads(body)["files"]:
        if f["filename"] == filename:
            url, sha256 = urllib.parse.urljoin(page, f["url"]), f.get("hashes", {}).get("sha256")
else:
    class Links(html.parser.HTMLParser):
        def handle_starttag(self, tag, attrs):
            global url, sha256
            href = dict(attrs).get("href") or ""
            if tag == "a" and href.split("#")[0].endswith("/" + filename):
                url = urllib.parse.urljoin(page, href.split("#")[0])
                frag = href.partition("#")[2]
                sha256 = frag.partition("=")[2] if frag.startswith("sha256=") else None
    Links().feed(body.decode())
if url is None:
    sys.exit(f"{page} lists no {filename}")
print(f"downloading {url}")
digest = hashlib.sha256()
with tempfile.TemporaryFile() as tmp:
    with urllib.request.urlopen(url, timeout=300) as r:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            tmp.write(chunk)
    if sha256 and digest.hexdigest() != sha256:
        sys.exit(f"{filename}: sha256 {digest.hexdigest()} != the index's {sha256}")
    tmp.seek(0)
    prefix = f"vllm-{version}/tests/"
    with tarfile.open(fileobj=tmp, mode="r:gz") as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and (m.isfile() or m.isdir()):
                m.name = m.name[len(f"vllm-{version}/"):]
                members.append(m)
        tar.extractall(dest, members=members, filter="data")
print(f"{sum(m.isfile() for m in members)} files of {filename}'s tests/ unpacked into {dest}")
PY
echo "$VERSION" > "$READY"
echo "vLLM $VERSION tests fetched into $DEST in $(( $(date +%s) - start )) s"
