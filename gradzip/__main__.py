from gradzip.lab.cli import main

raise SystemExit(main())
