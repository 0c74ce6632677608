"""Payload serialization: the bytes a fragment's tensors travel as through the object store.

- ``header``: the payload format (named tensors in their storage dtypes, in a safetensors file,
  optionally compressed): what a payload stores and declares, and the checks of a header.
- ``writer`` and ``reader``: the one writer of the format's bytes and its one strict reader,
  piece by piece; ``budget``: how much of either runs at once (threads, piece size, spool).
- ``stream``: payloads as streams, produced, hashed and compressed piece by piece
  (``PayloadStream``), and read, verified and decoded as their parts arrive (``decode_stream``).
- ``payload``: the same as one ``bytes`` (``encode_payload``, ``decode_payload``).
- ``plan`` and ``chunked``: the chunk plan of a chunked payload (a fragment's tensors cut into
  fixed chunks) and one chunk encoded from its pieces and decoded against its place in the plan.
- ``quant``: float32 to and from the storage dtypes (BF16, F16, F8 E4M3 with a per-tensor scale,
  F4 E2M1 with a scale per block of 32; I2, two-bit codes with a scale per block of 32, is in
  ``quant_i2``), round-to-nearest-even (I2: its own tie rule), the same bytes on every host;
  its minifloat grids and code tables are public for the device quantizers
  (``adapters.torch_quant``).
- ``compress``: lossless byte-plane shuffle plus one zstd frame per tensor (multi-threaded from
  8 MiB).
- ``safetensors_io``: the safetensors container itself, canonical on write, validated on read.
"""
