from hopsched.cli.main import main

main()
