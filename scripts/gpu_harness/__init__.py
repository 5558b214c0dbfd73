"""hvdx's TensorFlow-free kernel harness: the Python side.

The CUDA kernels of MSTopK (Shi et al., "Towards Scalable Distributed Training of Deep
Learning on Public Cloud Clusters", MLSys 2021, arXiv:2010.10458, Algorithm 1) and of
sparse accumulation (its Algorithm 2, line 9) are TensorFlow ops, and the GPU machines
this project is lent have no TensorFlow. csrc/harness builds the same kernel sources into
a plain shared library with a C ABI; this package drives it with NumPy arrays (CPU) and
device pointers (its own buffers, CuPy or PyTorch) and needs nothing but NumPy:

    lib      build (CMake) and load (ctypes) the library; call its functions
    inputs   the distributions of benchmarks/topk.py and the edge cases of the tests
    checks   parity with tests/mstopk_reference.py and between CPU and GPU kernels,
             determinism run to run, injected launch errors
    bench    the paper's Figure 6 on a GPU: MSTopK vs torch.topk, CuPy and one read of x;
             sparse accumulation vs scatter-adds (needs PyTorch; CuPy optional)
    run      the command line of scripts/gpu_harness.sh

It lives in scripts/ rather than in the hvdx package because it is a development tool
that builds from the source tree (csrc/) and must import without TensorFlow, which
`import hvdx` needs.
"""
