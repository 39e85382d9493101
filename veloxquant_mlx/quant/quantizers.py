"""TurboQuant quantizers: encode (..., d) vectors to packed codes, decode, and score inner products."""
from veloxquant_mlx.quant.turboquant_mse import TurboQuantMSE
from veloxquant_mlx.quant.turboquant_prod import TurboQuantProd
from veloxquant_mlx.quant.turboquant_rvq import TurboQuantRVQ

QUANTIZERS = {
    "turboquant_mse": TurboQuantMSE,
    "turboquant_prod": TurboQuantProd,
    "turboquant_rvq": TurboQuantRVQ,
}

__all__ = ["QUANTIZERS", "TurboQuantMSE", "TurboQuantProd", "TurboQuantRVQ"]
