"""Implementations of the fused op's forward contract (CONTRACT.md).

``nnkloss.ops.cpu``: the compiled CPU kernel (C++ built on first use, loaded with ctypes).
"""
