from hopsched.cli import main

main()
