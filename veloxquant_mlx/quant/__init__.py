"""The maths, pure functions of arrays and the buffers they fill: rotations (`rotation`), Lloyd-Max codebooks
(`codebooks`), bit packing (`bit_pack`: `BitPackBuffer`), the encoded vector the quantizers return
(`encoded_vector`: `EncodedVector`), the TurboQuant quantizers (`turboquant_mse`, `turboquant_prod`,
`turboquant_rvq`; `quantizers`: the registry `QUANTIZERS`; `quantizer_common`: their shared checks), channel
weights from second moments (`channel_weights`), and the growable slot store the caches keep codes in
(`slot_store`: `SlotStore`). Nothing here imports a cache, attention or mlx_lm.
"""
