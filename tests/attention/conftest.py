"""Make the attention test reference (attn_reference.py) importable (pytest runs with
--import-mode=importlib, which does not put test directories on sys.path)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
