"""Fold rules for the taylornet family (issue 17): none are needed, by design.

- A :class:`~polyfhe.models.layers.taylor.TaylorLayer` holds only constant weights (factor matrices, cores, bias)
  and no statistic of the data, so the driver keeps it as is; its forward is already add/mul-only.
- TaylorNet / R-TaylorNet have no normalisation at all (registry norm "none").
- The Taylor-Mixer's pre-norms are ResMLP Affines, which the generic rule (:mod:`polyfhe.fold.rules`) turns into
  exact ``ConstantAffine`` maps. Folding them further into the Taylor layer's input factors is not possible in
  general: the token-mixing layer is shared by all channels while the Affine scales each channel differently,
  and a shift ``beta`` would need bias terms inside the projections. The analyzer and the CKKS compiler merge a
  ``ConstantAffine`` with the adjacent projection anyway (measured: a depth-2 Taylor-Mixer analyses to the same
  9 levels with and without its Affines), so a dedicated rule would save nothing.

Fold exactness (float64, <= 1e-9) is tested in ``tests/models/test_taylornet.py``.
"""
