from autoshard._src.cli import main

raise SystemExit(main())
