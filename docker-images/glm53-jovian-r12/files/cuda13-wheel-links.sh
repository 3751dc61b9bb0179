#!/bin/sh
# CUDA 13 wheel links the seed's r12 build needed (torch stage of glm53-jovian-r12), both idempotent:
#  1. headers: the CUDA 13 pip wheels (nvidia/cu13/include, or one include/ per library in older
#     layouts) ship headers such as cusparse.h that the build looks up in the toolkit's include
#     folder; each header the toolkit lacks is linked there (existing headers are left alone);
#  2. libnvrtc.so: DeepGEMM's link step asks for -lnvrtc, and only versioned libnvrtc.so.N exist
#     in the wheel's lib folder; an unversioned link is added beside the newest one.
set -eu
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cuda_inc=/usr/local/cuda/include
linked=0
for inc in "$site"/nvidia/cu13/include "$site"/nvidia/*/include; do
    [ -d "$inc" ] || continue
    for h in "$inc"/*.h; do
        [ -e "$h" ] || continue
        name=$(basename "$h")
        if [ ! -e "$cuda_inc/$name" ]; then
            ln -s "$h" "$cuda_inc/$name"
            linked=$((linked + 1))
        fi
    done
done
echo "cuda13-wheel-links: $linked header(s) linked into $cuda_inc"
for lib in "$site"/nvidia/cu13/lib "$site"/nvidia/cuda_nvrtc/lib /usr/local/cuda/lib64; do
    [ -d "$lib" ] || continue
    [ -e "$lib/libnvrtc.so" ] && continue
    newest=$(ls "$lib"/libnvrtc.so.* 2>/dev/null | sort -V | tail -n 1 || true)
    if [ -n "$newest" ]; then
        ln -s "$(basename "$newest")" "$lib/libnvrtc.so"
        echo "cuda13-wheel-links: $lib/libnvrtc.so -> $(basename "$newest")"
    fi
done
