from ckpt_audit.cli import main

main()
