# Sourced by the GPU run scripts (`. docs/gpu/install-wheels.sh DIR`): installs what travelled with
# the call — flash_attn3_jax from .whl/ into /tmp/site, flash-attn-4 from .fa4b/ (after the .fa4a
# stash in /root/keep; ../shared/tools/fa4-wheels.sh) into /tmp/fa4 — exports the PYTHONPATH that
# finds them and a JAX compilation cache, and writes the cards and versions to DIR/gpus.txt.
# A part that is absent is skipped; an FA4 install that fails is noted in DIR/notes.txt (torch's
# `auto` then resolves to FA2 and the run says so) rather than stopping the run.
_rb_dir=${1:-/tmp}; mkdir -p "$_rb_dir"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
if [ -d .fa4b ]; then
  bash .fa4b/install.sh || echo "fa4 not installed: torch's blocks and anchor fall back to FA2" >> "$_rb_dir/notes.txt"
fi
export PYTHONPATH=/tmp/site:/tmp/fa4:/tmp/fa4/nvidia_cutlass_dsl/dsl_packages:$PWD
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$_rb_dir/gpus.txt" 2>&1 || true
python3 -c "import torch, jax; print('torch', torch.__version__, 'jax', jax.__version__)" >> "$_rb_dir/gpus.txt" 2>&1 || true
unset _rb_dir
