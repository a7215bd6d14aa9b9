"""redfuser-ops generator: YAML specs of cascaded reductions -> symbolic forms -> kernels.

Build-time only: nothing here is imported by the installed package at run time.
"""

__version__ = "0.1.0"
