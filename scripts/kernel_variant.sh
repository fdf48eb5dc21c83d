#!/usr/bin/env bash
# A kernel variant for an A/B, made here before a device call (it travels as untracked files):
#
#     bash scripts/kernel_variant.sh NAME PATCH...
#
# copies cuda_src/*.cuh and *.cu into cuda_src/NAME/ and applies the cuda_src/ hunks of each PATCH there, in order.
# A kernel file's quoted includes resolve next to it first, so cuda_src/NAME/fwd_sm90.cu compiles against the
# patched headers while every other kernel keeps cuda_src/'s; CUFLASH_FWD_SM90_SOURCE=NAME/fwd_sm90.cu selects it
# (scripts/gpu_fwd_source_ab.sh's SOURCES and TEST_SOURCE), CUFLASH_BWD_SM90_SOURCE=NAME/bwd_sm90.cu the
# backward's (the switch scripts/gpu_session17.sh patches into cuflash/hopper.py). Other hunks of a patch
# (cuflash/...) are not applied: apply them to the tree where every set needs them. Remove the folder before
# committing.
set -eu
name=${1:?NAME}
shift
dir=cuda_src/$name
rm -rf "$dir"
mkdir -p "$dir"
cp cuda_src/*.cuh cuda_src/*.cu "$dir/"
for patch in "$@"; do
    git apply -p2 --directory="$dir" --include="$dir/*.cu*" "$patch"
done
echo "$dir: $(ls "$dir" | wc -l) files, patched by $*"
