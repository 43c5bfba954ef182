"""The measuring layer: the cost model, the timing harness, provenance and the writing of results and figures."""
