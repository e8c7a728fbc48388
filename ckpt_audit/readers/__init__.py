"""Readers: the only code that opens checkpoint files. No torch.

Streaming hash and zip CRC (`hashing`), the zip central directory (`ptzip`), the restricted unpickler (`unpickler`),
what torch's pickles name and the one allowlist (`torch_globals`), and the `.pt` structure reader (`pt_structure`).
They return facts and `problem.Problem`s (a finding code plus its line), never prose for the rules to parse; judging
them is the rules' job.
"""
