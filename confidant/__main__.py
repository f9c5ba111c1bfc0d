from confidant.cli import main

raise SystemExit(main())
