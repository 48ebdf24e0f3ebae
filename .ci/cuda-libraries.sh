# Sourced by the GPU checks: finds the CUDA libraries wherever they are installed (a
# toolkit under /usr/local, or the PyTorch wheels' site-packages) and puts them on
# LD_LIBRARY_PATH. cudarc loads them by the unversioned names, so those are linked in a
# directory of their own. A plain search for `libnvrtc.so` also finds the toolkit's
# link-time stubs (`lib/stubs/`), which load and then answer with garbage (an NVRTC "PTX
# size" of exabytes), so those names are never linked.
find / -xdev \( -name 'libcublas.so*' -o -name 'libnvrtc.so*' -o -name 'libcudnn.so*' \) \
  -not -path '/proc/*' 2>/dev/null | sort
cublas="$(find / -xdev -name 'libcublas.so.1[0-9]' -not -path '/proc/*' 2>/dev/null | sort -V | tail -1)"
cudnn="$(find / -xdev -name 'libcudnn.so.9' -not -path '/proc/*' 2>/dev/null | head -1)"
cuda_directory="$(dirname "$cublas")"
links="$(mktemp -d)"
for library in libcublas libcublasLt libnvrtc; do
  versioned="$(ls "$cuda_directory/$library".so.1[0-9] 2>/dev/null | sort -V | tail -1)"
  [ -n "$versioned" ] && ln -sf "$versioned" "$links/$library.so"
done
export LD_LIBRARY_PATH="$links:$cuda_directory:$(dirname "$cudnn"):${LD_LIBRARY_PATH:-}"
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
ls -l "$links"
