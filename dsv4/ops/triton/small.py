"""Small decode ops as Triton kernels (issue 10 item 5): mHC pre/post and the head collapse,
RMSNorm, RoPE and their fusions, the FP8/FP4 round trips and cache stores, the Hadamard
rotation, the compressor's pooling, SwiGLU, the MoE router (scores + top-k), the speculative window
rollback. The kernels live in the ``small_*`` modules beside
this one; this module gathers their registrations.
"""

from __future__ import annotations

from . import (small_compressor, small_mhc, small_misc, small_quant, small_queries, small_rollback, small_router,
               small_rows)

REGISTRATIONS = [*small_mhc.REGISTRATIONS, *small_rows.REGISTRATIONS, *small_quant.REGISTRATIONS,
                 *small_misc.REGISTRATIONS, *small_compressor.REGISTRATIONS, *small_router.REGISTRATIONS,
                 *small_queries.REGISTRATIONS,
                 *small_rollback.REGISTRATIONS]
