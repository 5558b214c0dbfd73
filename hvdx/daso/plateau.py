"""DASO's plateau rule is hvdx's one `PlateauDetector` (`hvdx.plateau`); this name stays for
the code that imported it from here."""
from hvdx.plateau import PlateauDetector

__all__ = ["PlateauDetector"]
