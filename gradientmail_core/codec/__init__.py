"""Payload serialization: the bytes a fragment's tensors travel as through the object store.

- ``header``: the payload format (named tensors in their storage dtypes, in a safetensors file,
  optionally compressed): what a payload stores and declares, and the checks of a header.
- ``payload``: the one writer of the format's bytes and its one strict reader, behind one entry
  each: ``encode_payload`` (whole ``bytes``, or with ``stream=True`` a ``PayloadStream``
  produced, hashed and compressed piece by piece) and ``decode_payload`` (whole bytes, or parts
  read, verified and decoded as they arrive); either with ``chunk=`` / a ``ChunkSpec`` for one
  chunk of a chunked payload.
- ``plan``: the chunk plan of a chunked payload (a fragment's tensors cut into fixed chunks), and
  what each chunk stores (``ChunkSpec``).
- ``quant``: float32 to and from the storage dtypes (BF16, F16, F8 E4M3 with a per-tensor scale,
  F4 E2M1 with a scale per block of 32; I2, two-bit codes with a scale per block of 32, is in
  ``quant_i2``; the E8M0 scale bytes in ``e8m0``), round-to-nearest-even (I2: its own tie rule),
  the same bytes on every host; its minifloat grids and code tables are public for the device
  quantizers (``adapters.torch_quant``).
- ``compress``: lossless byte-plane shuffle plus one zstd frame per tensor (multi-threaded from
  8 MiB).
- ``safetensors_io``: the safetensors container itself, canonical on write, validated on read.
"""
