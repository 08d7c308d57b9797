; Inno Setup script: a per-user installer for the one-folder bundle dist\cleave-app.
;
; Built by packaging\windows\build.ps1, which runs PyInstaller first and passes the
; version:  ISCC.exe /DAppVersion=0.1.0 packaging\windows\cleave-app.iss
; Output:   dist\cleave-app-<version>-setup.exe
;
; Per-user (no admin prompt): volunteers install it like any app from a download,
; and the worker's settings live in %APPDATA%\Cleave either way.

#ifndef AppVersion
  #error Pass the version: ISCC /DAppVersion=X.Y.Z cleave-app.iss (build.ps1 does)
#endif
#define RepoRoot AddBackslash(SourcePath) + "..\.."

[Setup]
; A fixed AppId keeps upgrades and uninstalls pointing at the same installation.
AppId={{6F1E2B4C-3D5A-4E7F-9A8B-C1D2E3F40516}
AppName=Cleave
AppVersion={#AppVersion}
AppPublisher=Cleave maintainers
AppComments=Donate this computer's spare CPU/GPU time to neural-network training
DefaultDirName={autopf}\Cleave
DefaultGroupName=Cleave
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir={#RepoRoot}\dist
OutputBaseFilename=cleave-app-{#AppVersion}-setup
SetupIconFile={#RepoRoot}\build\windows\cleave.ico
UninstallDisplayIcon={app}\cleave-app.exe
; torch is most of the ~700 MB: LZMA2 solid brings the installer to ~150 MB.
Compression=lzma2/max
SolidCompression=yes
WizardStyle=modern

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Files]
Source: "{#RepoRoot}\dist\cleave-app\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\Cleave"; Filename: "{app}\cleave-app.exe"
Name: "{autodesktop}\Cleave"; Filename: "{app}\cleave-app.exe"; Tasks: desktopicon

[Run]
Filename: "{app}\cleave-app.exe"; Description: "{cm:LaunchProgram,Cleave}"; Flags: nowait postinstall skipifsilent

[UninstallRun]
; "Start at login" writes a Run key under HKCU; leave no autostart pointing at a
; removed program. (Settings and the pinned keys in %APPDATA%\Cleave are kept.)
Filename: "reg.exe"; Parameters: "delete HKCU\Software\Microsoft\Windows\CurrentVersion\Run /v Cleave /f"; Flags: runhidden; RunOnceId: "RemoveCleaveAutostart"
