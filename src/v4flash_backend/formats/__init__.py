"""Number formats and the checkpoint layout (layer 2; imports only `config`).

`quant`: e4m3fn / e2m1 / ue8m0 codecs, MXFP4 packing and the model's fake-quant points.
`checkpoint`: the official safetensors layout (sliced shard reads, writer, shard index).
"""
