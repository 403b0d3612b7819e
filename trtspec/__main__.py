from trtspec.cli.app import main

main()
