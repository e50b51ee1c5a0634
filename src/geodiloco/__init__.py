"""geodiloco: DiLoCo-style training of one model across datacenters."""

__version__ = "0.1.0"
