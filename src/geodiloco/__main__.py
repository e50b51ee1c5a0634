from geodiloco.cli import main

raise SystemExit(main())
