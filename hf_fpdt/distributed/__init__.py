"""Distributed control: the SP and DP groups, process-group timeouts, the chunked all-to-all, the ranks'
agreement (structure, steps, digests of weights and values) and peer failures, and the SP loss. Knows nothing of
attention numerics; sits below ``attention/``."""
