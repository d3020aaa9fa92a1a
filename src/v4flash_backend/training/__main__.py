from .tiny import main

raise SystemExit(main())
