import os
import sys

# tests/ holds helper modules (builders, netlab, apiemu) imported by the tests.
sys.path.insert(0, os.path.dirname(__file__))
