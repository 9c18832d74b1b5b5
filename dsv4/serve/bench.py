def run_bench(args): raise NotImplementedError
