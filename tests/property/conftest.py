"""Tier ``property`` (marker ``property``): hypothesis draws random valid configurations that
nobody picked by hand (meshes, shapes, dtypes incl. float16, scales) and both frameworks must meet
the numerics policy; 200 derandomized examples by default, 1000 with ``--full``."""
