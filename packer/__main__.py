from packer.cli import run

run()
