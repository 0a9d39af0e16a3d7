from packer.cli import main

raise SystemExit(main())
