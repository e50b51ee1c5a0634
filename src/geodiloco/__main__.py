from geodiloco.app.cli import main

raise SystemExit(main())
