from sao.cli import main

main()
