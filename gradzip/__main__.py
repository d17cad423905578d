from gradzip.cli import main

raise SystemExit(main())
