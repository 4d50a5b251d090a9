from mtpwrap.cli import main

main()
