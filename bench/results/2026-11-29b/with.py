"""Run a bench script with dsv4.ops.triton.moe's constants set: with.py NAME=VALUE[,NAME=VALUE] script.py args..."""
import runpy
import sys

from dsv4.ops.triton import moe

for item in sys.argv[1].split(","):
    name, value = item.split("=")
    assert hasattr(moe, name), name
    setattr(moe, name, int(value))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
