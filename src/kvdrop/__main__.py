from kvdrop.cli import main

raise SystemExit(main())
