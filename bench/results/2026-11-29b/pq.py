"""Run a bench script with moe_decode.PREQUANT set (the prequant experiment): pq.py N script.py args..."""
import runpy
import sys

from dsv4.ops.triton import moe_decode

moe_decode.PREQUANT = int(sys.argv[1])
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
