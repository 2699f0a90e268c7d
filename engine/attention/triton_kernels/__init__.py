"""Triton kernels of the paged attention backend, one kernel family per module.

- ``kv_write``: store a step's new K/V rows into their cache slots.
- ``decode``: paged decode attention split along the sequence (flash-decoding).
- ``extend``: prefill over a cached prefix, many requests of any length in one launch.
- ``launch``: launch-time helpers shared by the three (tile choice, interpreter check).

Importing a module here imports ``triton``; set ``TRITON_INTERPRET=1`` before that
import to run the kernels on CPU tensors (tests do).
"""
