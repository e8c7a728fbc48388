"""Readers: the only code that opens checkpoint files. No torch.

Streaming hash and zip CRC (`hashing`), the zip central directory (`ptzip`), the restricted unpickler (`unpickler`),
what torch's pickles name and the one allowlist (`torch_globals`), and the `.pt` structure reader (`pt`).
They return facts and `problem.Problem`s (a finding code plus its line), never prose for the rules to parse; judging
them is the rules' job.
"""

# What the readers check in bytes they read. Bump it whenever a reader finds something in bytes it used to pass (or
# records a new fact the rules read): a catalog row read under other rules no longer vouches for its file (its
# verified_ns reads as never, catalog.manifest.fact_columns), so the next scan reads that file again instead of
# reusing findings today's readers would not give. 2: zip directory against local headers and data, safetensors
# headers checked as safetensors loads them, .distcp items unpickled, bounded pickles and JSON (issue 26).
RULES = 2
