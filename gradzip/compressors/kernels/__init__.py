"""The codecs' speed layer: bit packing and byte accounting (``wire``), the hashed dither,
sums in one defined order, NumPy-backed elementwise primitives, compiled (``fused``) and C
(``native``) loops. Codec files hold the method's arithmetic and call these; the fast path is
chosen here once per device and dtype, not branched on inside each codec."""
