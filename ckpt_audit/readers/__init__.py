"""Readers: the only code that opens checkpoint files. No torch.

Streaming hash and zip CRC (`hashing`), the zip central directory (`ptzip`), and the restricted unpickler with the
`.pt` structure reader (`pickles`). They return facts and finding codes; judging them is the rules' job.
"""
