# Sourced by the GPU-machine scripts: install the wheels under .whl/ and put slothkit on
# the path.  A GPU machine may reach no registry, so packages travel as wheels under .whl/
# (git-ignored), in subfolders so that a copy of the checkout carries only what its
# run needs (docs/gpu-runs.md):
#   .whl/base     bitsandbytes, liger-kernel, dill, multiprocess, xxhash
#   .whl/trl116   trl 1.16 and datasets 5.2 (what slothkit's TRL tests use)
#   .whl/unsloth  unsloth + unsloth_zoo (studio/ stripped), trl 1.15, datasets 4.8.5
#   .whl/gguf     gguf, llama-cpp-python (the export timing)
OUT="${OUT:-$PWD/gpu-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
site=/tmp/site; mkdir -p "$site"
wheels=$(ls .whl/*.whl .whl/*/*.whl 2>/dev/null)
# A machine still warm from the last call has these wheels in $site already: installing
# them again costs device time, so the set installed is remembered by name and size.
installed=$(ls -l $wheels 2>/dev/null | awk '{print $5, $NF}' | sha1sum | cut -c1-40)
if [ -n "$wheels" ] && [ "$(cat "$site/.wheels" 2>/dev/null)" != "$installed" ]; then
    if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" $wheels > "$site/.pip.log" 2>&1; then
        echo "$installed" > "$site/.wheels"
    fi
    grep -v "^WARNING\|already exists" "$site/.pip.log" | tail -n 5
fi
if ls .whl/slothkit/slothkit-*.whl > /dev/null 2>&1; then
    # A slothkit wheel travelled (built here with `pip wheel --no-deps -w .whl/slothkit .`):
    # it is what users install, so it is what runs. PYTHONSAFEPATH keeps `python3 -m` from
    # putting the checkout's slothkit/ ahead of it on the path.
    for link in "$site/slothkit_kernels" "$site/slothkit_templates"; do  # left by a source run
        if [ -L "$link" ]; then rm "$link"; fi
    done
    export PYTHONPATH="$site" PYTHONSAFEPATH=1
    (cd /tmp && python3 -c "import slothkit; print('slothkit from', slothkit.__file__)") | tee -a "$OUT/gpu.txt"
else
    # slothkit_templates is templates/ under another name (see pyproject.toml);
    # slothkit and slothkit_kernels are found in the checkout.
    ln -sfn "$PWD/templates" "$site/slothkit_templates"
    export PYTHONPATH="$site:$PWD"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
