"""pytest: the shared helpers (hostlib) are importable from every test folder here."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
