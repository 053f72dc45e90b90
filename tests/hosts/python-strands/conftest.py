"""pytest: the shared helpers (tests/hosts/python/hostlib.py) are importable here."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
