"""The sizes the generated CPU kernels are cut by, and the x86-64 levels each kernel is compiled for.

Read by the row kernel's emitter (cpu.py) and the block mode's (cpu_tiles.py); the block mode's own tile sizes
stay with it.
"""

CHUNK = 64  # the chunk of row kernels with per-element state (folds, a free index) and of block kernels without tiles
ROW_CHUNK = 512  # the chunk of plain row kernels (see CpuKernel.chunk)
SEL_CHUNK = 256  # the chunk of row kernels with a selection: rf::sel_candidates finds k candidates per chunk
LANES = 16  # partial results of a branch-free reduction over a chunk (one vector of floats on AVX-512)
UNROLL = 4  # elements of a chunk that share one pass over a contraction axis or a free axis
ROW_TASK_ELEMENTS = 1 << 16  # elements of the streamed axis per task of a row kernel (its grain in rows follows)
TCACHE_MAX = 1 << 18  # longest row whose summed terms are kept for its per-element outputs (1 MiB of floats)

# one copy of each kernel per x86-64 level, chosen at load time (glibc ifunc): AVX-512 / AVX2+FMA / baseline,
# so that one wheel runs everywhere and the inner loops use the widest vectors the CPU has
TARGET_CLONES = (
    '#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)\n'
    '__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))\n'
    '#endif\n'
)
