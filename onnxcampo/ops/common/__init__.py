"""The code the op units share: C++ headers (op_util.h: attribute reading, the kernel and op
class templates, the registry; cuda_util.h, parallel.h, ints_text.h), the library's entry
points (library.cc) and the node builders' helpers (nodes.py).
"""
